"""Plain-torch reference ops for Qwen4Exp (Qwen3.8 Flash-Next), one module per block.

Every op works on one or more sequences with explicit states, imports without vLLM and
runs on any device in fp32, fp16 or bf16. They are the semantics the vLLM adapter calls;
faster paths (kernels) must be tested against them.

- `common`: RMSNorm (``1 + weight``, optionally per group), partial rotary embedding.
- `gdn`: Gated DeltaNet (causal conv with state, gated delta rule chunked and recurrent).
- `gdn_varlen`: the GDN core of a whole engine step on vLLM's state slots (the CPU path).
- `qsa`: QSA indexed attention (compressed key blocks, budget, open group, output gate).
- `qsa_paged`: the same for every token of an engine step over vLLM's paged caches (torch
  references plus Triton kernels; no host syncs, CUDA-graph safe).
- `hyper_connection`: hyper-connection mixers (grouped norm, low-rank mix, injection), and the
  served model's three-kernel mixer (Triton on CUDA).
- `norm_rope`: per-head RMSNorm + partial RoPE as one op (Triton on CUDA).
- `qsa_step_metadata`: a QSA cache group's per-step metadata in one launch (Triton on CUDA).
- `triton_dispatch`: the one rule that picks an op's Triton path or its torch reference.
- `ple`: per-layer n-gram embeddings (hashing, gate, dilated conv, their states).
- `ple_varlen`: PLE of a whole engine step on vLLM's state slots (batched, CUDA-graph safe;
  Triton kernels for its rows, gate, conv and states on CUDA).
- `moe`: top-k routed experts with a gated shared expert.
"""
