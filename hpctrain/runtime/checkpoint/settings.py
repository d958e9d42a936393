"""Each parameter's optimizer settings as one checkpoint entry.

The flattened optimizer state dict (checkpointer.OPTIONS; torch's `flatten_optimizer_state_dict`) names
every parameter group setting once per parameter: `param_groups.<name>.lr`, `.betas`, `.eps`,
`.weight_decay`, ... 12 entries for each AdamW parameter, three quarters of a save's DCP items. DCP plans,
gathers, writes and indexes each item on its own (~0.1 ms apiece on the CPU, the small ones all on one rank
after its deduplication), which made the 4-layer benchmark's pause at dp2 longer than torchtitan's
(bench/torchtitan_compare.py ckpt-dp2, issue 23 item 8). A save keeps them as one entry per parameter,
`param_groups.<name>` = ((setting, value), ...), a tuple DCP stores whole (its traversal stops at tuples)
and the safe reader loads (`weights_only`: strings, numbers, booleans, None); still one entry per
parameter name, so a checkpoint loads into any layout as before. A load asks for the form the checkpoint
has: checkpoints saved before this keep one entry per setting and load as they are.
"""

from __future__ import annotations

from typing import Any

SECTION = "param_groups."


def group(optim: dict[str, Any]) -> dict[str, Any]:
    """The flattened optimizer state with each parameter's settings gathered into one entry."""
    out: dict[str, Any] = {}
    settings: dict[str, list[tuple[str, Any]]] = {}
    for key, value in optim.items():
        if key.startswith(SECTION):
            name, setting = key.rsplit(".", 1)  # parameter names have dots; setting names do not
            settings.setdefault(name, []).append((setting, value))
        else:
            out[key] = value
    out.update({name: tuple(pairs) for name, pairs in settings.items()})
    return out


def _is_grouped(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                            for p in value)


def ungroup(optim: dict[str, Any]) -> dict[str, Any]:
    """`group` undone: one entry per setting again, as torch's set_state_dict takes them."""
    out: dict[str, Any] = {}
    for key, value in optim.items():
        if key.startswith(SECTION) and _is_grouped(value):
            out.update({f"{key}.{setting}": item for setting, item in value})
        else:
            out[key] = value
    return out


def saved_grouped(optim: dict[str, Any], saved: set[str], section: str = "optim") -> bool:
    """Whether the checkpoint whose DCP keys are `saved` keeps the settings of these (grouped) entries whole."""
    return any(f"{section}.{key}" in saved for key in optim if key.startswith(SECTION))
