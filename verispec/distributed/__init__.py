"""Tensor parallelism: one target model split across ranks on torch.distributed.

    sharding.py  which slice of each weight a rank holds (Megatron's layout)
    layers.py    the collectives, added to a rank's ordinary LlamaModel from outside
    loading.py   one rank's model from the model's files (only its slices are read)
    ranks.py     rank 0's handle on the worker processes: start, feed, notice loss, stop
    runner.py    rank 0's target runner: rows to every rank, then the forward here
    worker.py    a worker rank's process: the forward only
    torchrun.py  ranks started by torchrun instead: a rank > 0 becomes a worker

Rank 0 is the engine's process: scheduling, proposers (a draft model stays whole, on
rank 0 only), sampling, the rejection test and the speculation policy all run there,
once, on the gathered logits. Workers receive each forward's rows and run the same
forward on their slices. gloo on the CPU, NCCL on CUDA. `LLMEngine.from_config` starts
the ranks (or joins torchrun's) when `EngineConfig.tensor_parallel_size` > 1;
`LLMEngine.shutdown` stops them.
"""
