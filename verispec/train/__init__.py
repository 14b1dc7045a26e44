"""Draft training: distil a small draft model from the target's own outputs.

    traces  -> run the target (verispec's engine) on instruction/chat prompts; keep its
               outputs and its top-k log-probabilities at every generated position
    filter  -> deduplicate, drop degenerate outputs, decontaminate against every benchmark
               prompt set (word 13-gram overlap); a report with the counts
    train   -> a few-layer Llama draft initialised from the target's embeddings and layers,
               trained with top-k distillation (KL to the renormalised top-k + CE)
    export  -> a Hugging Face-format directory that `--draft-model` loads, written where the
               draft registry (`verispec.train.registry`) finds it for `--spec draft`

Every stage is idempotent and resumable: it records what it was run with, skips work that
is done, and refuses to mix results made with different settings.
"""
