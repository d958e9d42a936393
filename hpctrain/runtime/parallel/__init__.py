"""Parallelism, one module per dimension: tensor.py (TP), sequence.py (SP, with TP), vocab.py (the
vocabulary-sharded embedding and loss), pipeline.py (PP stages and schedules), fsdp.py (FSDP2 data
parallel, ZeRO 1-3); expert and context parallelism get expert.py and context.py next to them.
Around them: dims.py (ParallelDims: the validated degrees and the device mesh),
activation_checkpoint.py, compile.py, precision.py (autocast, fp16 loss scaling, the SDPA kernel),
float8.py (train.precision fp8: torchao's float8 linears; mxfp8.py, recipe mxfp8), host_embedding.py (train.embedding_on_cpu) and
grad_norm.py (the global gradient norm over shards)."""
