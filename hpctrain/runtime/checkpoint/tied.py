"""A tied head loaded from a checkpoint that has no head of its own.

Without pipelining a tied head *is* the embedding: one parameter, saved once under
`tok_embeddings.weight` (the optimizer's flattened state too: `state.tok_embeddings.weight.*`).
On a multi-stage pipeline the last stage holds its own copy, `output.weight` (model/transformer.py
`make_stage`), which starts equal to the embedding and gets the same summed gradient every step, so
its optimizer state equals the embedding's as well. A checkpoint saved without pipelining therefore
lacks the `output.weight` keys of the optimizer a pipelined last stage asks for (DCP: "Missing key in
checkpoint state_dict: optim.state.output.weight.step"; the model's state dict names the tied tensor
under both names); each missing head key is read from the embedding's. A checkpoint saved with
pipelining has both and loads as it is.
"""

from __future__ import annotations

from typing import Any

HEAD = "output.weight"
EMBEDDING = "tok_embeddings.weight"


def _embedding_key(key: str) -> str | None:
    """`output.weight` (model), `state.output.weight.X` / `param_groups.output.weight.X` (optimizer,
    flattened) or `param_groups.output.weight` (its settings as one entry, settings.py) -> the same key of the
    embedding; None for any other key."""
    if key == HEAD:
        return EMBEDDING
    if key == "param_groups." + HEAD:
        return "param_groups." + EMBEDDING
    for section in ("state.", "param_groups."):
        if key.startswith(section + HEAD + "."):
            return section + EMBEDDING + key[len(section + HEAD):]
    return None


def aliases(state: dict[str, dict[str, Any]], saved: set[str], tied_copy: bool) -> dict[tuple[str, str], str]:
    """{(section, key): key to read instead} for each head entry the checkpoint lacks.

    `state` is {"model": {...}, "optim": {...}} as the Checkpointer loads it; `saved` the checkpoint's
    flattened keys ("model.output.weight", "optim.state.output.weight.step", ...)."""
    if not tied_copy:
        return {}
    out = {}
    for section, entries in state.items():
        for key in entries:
            source = _embedding_key(key)
            if source is not None and f"{section}.{key}" not in saved and f"{section}.{source}" in saved:
                out[(section, key)] = source
    return out


def rename_for_load(state: dict[str, dict[str, Any]], alias: dict[tuple[str, str], str]) -> dict[str, dict[str, Any]]:
    """The dict to hand to DCP: the aliased entries under the embedding's keys. Where this rank holds
    the embedding too (one rank with the first and the last stage) the embedding's own entry stays
    and the head takes its value in `restore`: one key is read into one place only."""
    load: dict[str, dict[str, Any]] = {section: {} for section in state}
    for section, entries in state.items():
        for key, value in entries.items():
            if (section, key) not in alias:
                load[section][key] = value
    for (section, key), source in alias.items():
        load[section].setdefault(source, state[section][key])
    return load


def restore(state: dict[str, dict[str, Any]], load: dict[str, dict[str, Any]],
            alias: dict[tuple[str, str], str]) -> None:
    """Put what DCP read back into `state`. DCP loads tensors in place but replaces other values (a
    step count, a learning rate) in the dict it was given, so every entry is taken from `load`; the
    head's entries take the embedding's."""
    for section, entries in load.items():
        for key, value in entries.items():
            if key in state[section] and (section, key) not in alias:
                state[section][key] = value
    for (section, key), source in alias.items():
        state[section][key] = load[section][source]
