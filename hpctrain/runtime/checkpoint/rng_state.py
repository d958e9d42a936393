"""A rank's RNG states as plain tensors and numbers, loadable with `torch.load(weights_only=True)`.

The checkpoint folder may be shared and writable by others (issue 18 finding 4): unpickling it with
weights_only=False would run whatever code a writer put there. So the Python and numpy Mersenne
Twister states, which are tuples of ints and numpy arrays, are stored as int64 tensors and numbers,
and the loader accepts nothing else.
"""

from __future__ import annotations

import random
from typing import Any, BinaryIO

import numpy as np
import torch

FORMAT = 2


class BadRngState(Exception):
    """An RNG file that is not in the safe format (e.g. written by an older hpctrain)."""


def capture(device_index: int | None = None) -> dict[str, Any]:
    """This rank's RNG states; on a GPU only its own device's (a resumed rank may see other GPUs)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "format": FORMAT,
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if device_index is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(device_index)
    return state


def save(handle: BinaryIO, device_index: int | None = None) -> None:
    torch.save(capture(device_index), handle)


def load(path: str) -> dict[str, Any]:
    """The state in path, read with weights_only=True; BadRngState if it is not in the safe format."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unpickling refusal means: not our safe format
        raise BadRngState(f"not a plain-tensor RNG file ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise BadRngState("not a plain-tensor RNG file (no format 2 marker)")
    try:
        num, py = state["numpy"], state["python"]
        numpy_state = (num["kind"], num["keys"].numpy().astype(np.uint32), int(num["pos"]),
                       int(num["has_gauss"]), float(num["cached_gaussian"]))
        gauss = py["gauss_next"]
        python_state = (int(py["version"]), tuple(int(x) for x in py["internal"].tolist()),
                        None if gauss is None else float(gauss))
        out = {"torch": state["torch"], "numpy": numpy_state, "python": python_state}
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise BadRngState(f"malformed RNG file ({type(exc).__name__}: {exc})") from None
    if "cuda" in state:
        out["cuda"] = state["cuda"]
    return out


def restore(state: dict[str, Any], device_index: int | None = None) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device_index is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], device_index)
