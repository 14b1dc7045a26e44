"""CPU per generated token of each process when `verispec serve --spec none` streams to one
openai client at 1 in flight (default model, 8 prompts x 128 tokens): the API process, the
engine-core process, and the client. On 2 cores everything but the engine pre-empts it.

    .venv/bin/python bench/experiments/serve_cpu_per_token.py
"""
import os, sys, time, json, subprocess, signal
import openai, httpx
port = 8131
srv = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--spec", "none", "--port", str(port), "--no-access-log", "--log-level", "warning"])
for _ in range(120):
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200: break
    except Exception: pass
    time.sleep(0.5)
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
children = [int(p) for p in open(f"/proc/{srv.pid}/task/{srv.pid}/children").read().split()]
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
model = c.models.list().data[0].id
msgs = [{"role": "user", "content": f"Write a short story about a robot number {i}."} for i in range(8)]
c.chat.completions.create(model=model, messages=[msgs[0]], max_tokens=16, temperature=0)
t0 = time.perf_counter(); a0 = cpu(srv.pid); e0 = [cpu(p) for p in children]; me0 = time.process_time()
n = 0
for m in msgs:
    for ch in c.chat.completions.create(model=model, messages=[m], max_tokens=128, temperature=0, stream=True, stream_options={"include_usage": True}):
        if ch.usage: n += ch.usage.completion_tokens
wall = time.perf_counter() - t0
print(json.dumps({"tokens": n, "wall_s": round(wall, 2), "tok_s": round(n / wall, 1),
                  "api_cpu_ms_per_token": round((cpu(srv.pid) - a0) * 1e3 / n, 3),
                  "engine_cpu_ms_per_token": [round((cpu(p) - e) * 1e3 / n, 3) for p, e in zip(children, e0)],
                  "client_cpu_ms_per_token": round((time.process_time() - me0) * 1e3 / n, 3)}))
srv.send_signal(signal.SIGTERM); srv.wait(30)
