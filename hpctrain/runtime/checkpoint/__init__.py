"""Checkpoints: the Checkpointer (checkpointer.py: save, finalize, prune, find and load, with the
protocol in its docstring), the file operations that make a save durable (files.py), sha256 of the
files while DCP writes them (hashing.py), DCP loading that unpickles nothing freely (safe_dcp.py), DCP's
save planner serialising each distinct plain value once (save_planner.py), each parameter's optimizer
settings as one entry (settings.py) and the RNG states saved as plain tensors (rng_state.py). What counts as a complete checkpoint is hpctrain.rundir.checkpoints
(torch-free, shared with launch)."""
