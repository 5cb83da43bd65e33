"""The SM70 platform's GPU worker: stock's, refusing weight reloads of SM70 AWQ models up front.

vLLM's in-place ``reload_weights`` first moves every layer's tensors to the meta device and then
loads layer by layer (``model_loader/reload/layerwise.py``), so a refusal from inside a
quantization method's hooks would come after other layers had changed. The SM70 platform sets
``parallel_config.worker_cls`` to this class (where stock's default worker was chosen), and its
reload and weight-transfer entry points check the model first (`awq_config.refuse_reload`):
with SM70 AWQ layers they raise before anything is touched (R25 / R55).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from sm70_backend.awq_config import refuse_reload

STOCK_WORKER = "vllm.v1.worker.gpu_worker.Worker"
SM70_WORKER = "sm70_backend.worker.Sm70Worker"


class Sm70Worker(Worker):
    def _refuse(self, what: str) -> None:
        refuse_reload(self.model_runner.get_model(), what)

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        self._refuse("reload_weights")
        super().reload_weights(*args, **kwargs)

    def start_weight_update(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("weight transfer (start_weight_update)")
        return super().start_weight_update(*args, **kwargs)

    def start_draft_weight_update(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("weight transfer (start_draft_weight_update)")
        return super().start_draft_weight_update(*args, **kwargs)

    def update_weights(self, *args: Any, **kwargs: Any) -> None:
        self._refuse("weight transfer (update_weights)")
        super().update_weights(*args, **kwargs)
