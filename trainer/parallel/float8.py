"""fp8 training through torchao (docs/performance.md#fp8): ``mixed_precision: fp8`` with the AO backend, as
``accelerate config`` writes it. The model's ``nn.Linear`` layers become torchao's ``Float8Linear`` before they are
placed or sharded (their matmuls in fp8 with dynamic scales; under FSDP2 their weights all-gathered in fp8), the rest
computes in bf16 over fp32 masters. The output head and layers whose sizes are not multiples of 16 stay in bf16.
The weights keep their names and dtype: checkpoints and exports are ordinary ones
(https://github.com/pytorch/ao/tree/main/torchao/float8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from trainer.errors import ConfigError
from trainer.launch.accelerate_config import launch_asks_for_fp8


@dataclass(frozen=True)
class Float8:
    """The fp8 settings of the launch (accelerate's ``AORecipeKwargs``: pad_inner_dim, fp8 all-gather under
    FSDP2, from ``ACCELERATE_FP8_*``)."""

    config: Any

    @classmethod
    def of_launch(cls, device: torch.device) -> Optional[Float8]:
        if not launch_asks_for_fp8():
            return None
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ConfigError(
                f"mixed_precision: fp8 needs a GPU with fp8 tensor cores (Ada or Hopper and later); this {name} has "
                "none: use bf16 (accelerate_configs/bf16.yaml)"
            )
        from accelerate.utils import AORecipeKwargs

        return cls(config=AORecipeKwargs().config)

    def convert(self, model: torch.nn.Module, *, sharded: bool) -> str:
        """Swap the model's eligible Linear layers in place; the banner's words (what stayed in bf16, by name).
        ``sharded``: their weights all-gathered in fp8 (as the launch's settings say), else plain (DDP)."""
        from torchao.float8 import convert_to_float8_training

        config = self.config if sharded else dataclasses.replace(self.config, enable_fsdp_float8_all_gather=False)
        head = getattr(model, "get_output_embeddings", lambda: None)()
        kept: dict[str, str] = {}

        def eligible(module: torch.nn.Module, name: str) -> bool:
            if not isinstance(module, torch.nn.Linear):
                return False
            if module is head:
                kept[name] = "the output head"
            elif module.in_features % 16 or module.out_features % 16:
                kept[name] = f"{module.in_features} x {module.out_features}, not multiples of 16"
            return name not in kept

        convert_to_float8_training(model, config=config, module_filter_fn=eligible)
        converted = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
        if not converted:
            raise ConfigError(
                f"mixed_precision: fp8: {type(model).__name__} has no nn.Linear layer torchao can run in fp8 "
                f"({len(kept)} kept in bf16; a Conv1D, as GPT-2's, is not one): use bf16"
            )
        words = f"fp8 (torchao) in {converted} Linear layers"
        if kept:
            named = [f"{name} ({why})" for name, why in list(kept.items())[:3]]
            more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
            words += f"; in bf16: {', '.join(named)}{more}"
        return words
