"""What the engine tests share about how their stock vLLM engines run.

`IN_PROCESS`: environment for an engine script (`vllm.LLM` in a subprocess of the test) whose
engine core runs in that script's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); at
tensor-parallel size 1 the worker runs there too (stock's CPU platform then keeps vLLM's
uniprocess executor), at larger sizes vLLM still spawns one worker process per rank. Every process
vLLM spawns imports torch and vLLM again, 10-20 s each on a 2-core machine, and the tokens,
logprobs and parameters these tests compare do not depend on which process computes them. vLLM's
default three-process layout (API server, engine core, worker) runs in the server tests
(tests/soak/test_soak.py and tests/tool_parsers/test_tool_parsers_server.py check that every plugin
registers in each of the three).
"""

from __future__ import annotations

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
