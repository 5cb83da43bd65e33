"""SM70 kernels: CUDA C++ compiled at run time by NVRTC (`nvrtc`), launched through the CUDA
driver (`driver`), dispatched by device next to their plain-torch references (`attention`,
`reference`). Nothing here imports vLLM."""
