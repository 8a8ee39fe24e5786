"""Stage two's one pass over the LM head: the student's ``[B, L, V]`` logits chunk by chunk (``head_logits``), the
rows a term counts (``loss_rows``), the pass over every vocabulary term of a step (``vocab_pass``) and, on CUDA
with triton, its fused kernel (``fused_vocab``, ``kernel_feeds``, ``kernel_guard``; ``vocab_kernels`` imports
triton and loads only when the kernel runs).

Part of the logit family: it imports nothing of either stage, and stage one loads it only with a logit kind's torch
half, at capture. Its users are those torch halves, whose loss terms are terms of this pass, and stage two's
losses and objective. Every module here imports torch; importers name the module that defines what they use.
"""
