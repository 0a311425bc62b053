"""Layout: how the devices of one model world are cut for attention, the MoE, dense layers and the LM head.

(Skeleton: parsing of --mesh and SGLang flags, presets and mesh building are added on top.)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1  # attention data-parallel groups (SGLang's --attn-dp-size)
    tp: int = 1  # devices per attention group (tensor-parallel attention inside a group)
    moe: str = "tp"  # "tp": every device a slice of every expert; "ep": whole experts per device
    dense_replicated: bool = False  # --moe-dense-tp-size 1: dense FFN layers whole on every device
    dp_lm_head: bool = False  # --enable-dp-lm-head: the whole LM head on every device
    replicas: int = 1  # --dp-size R: independent model copies, each its own mesh

    @property
    def world(self) -> int:
        """Devices of one model copy."""
        return self.dp * self.tp

    @property
    def total_devices(self) -> int:
        return self.world * self.replicas
