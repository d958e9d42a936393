"""The `train.lora:` section: low-rank adapters on the attention and MLP projections (Hu et al. 2021).

The projections are named as in the runtime's model (hpctrain/runtime/model/transformer.py): wq wk wv wo (attention),
w1 w2 w3 (MLP: gate, down, up). Hugging Face / PEFT names are accepted and mapped onto them.
"""

from typing import Any

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from hpctrain.config.base import Section

# Runtime name -> Hugging Face Llama name (PEFT's target_modules); the only mapping in the project.
HF_NAMES: dict[str, str] = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
                            "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
ALIASES: dict[str, str] = {**{name: name for name in HF_NAMES}, **{hf: name for name, hf in HF_NAMES.items()}}
ALL_TARGETS: tuple[str, ...] = tuple(HF_NAMES)
MAX_RANK = 4096


class LoraConfig(Section):
    """LoRA fine-tuning: the base weights are frozen, each targeted projection W gets W + (alpha/rank) B A."""

    rank: int = Field(8, ge=1, le=MAX_RANK, description="Adapter rank r (A is r x in, B is out x r).")
    alpha: float = Field(8.0, gt=0, le=1e6, description="Scaling numerator: the update is (alpha / rank) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (training only).")
    targets: list[str] = Field(list(ALL_TARGETS), min_length=1, max_length=len(ALL_TARGETS),
                               description="Projections to adapt: wq wk wv wo w1 w2 w3 (or q_proj k_proj v_proj "
                                           "o_proj gate_proj down_proj up_proj).",
                               json_schema_extra={"items": {"enum": list(ALIASES)}, "uniqueItems": True})

    @field_validator("targets", mode="before")
    @classmethod
    def _canonical(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # strict typing reports it
        out: list[str] = []
        for item in value:
            if not isinstance(item, str) or item not in ALIASES:
                raise PydanticCustomError("lora_target", "{item} is not a projection", {"item": repr(item)})
            if ALIASES[item] not in out:
                out.append(ALIASES[item])
        return out

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
