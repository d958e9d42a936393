"""The run-directory contract (docs/architecture.md: the run directory), shared by launch, runtime and diagnose.

Torch-free and import-light. Submodules are imported by name (`from hpctrain.rundir.events import
append_event`); nothing is imported here, so that modules can be added without touching this file.

    layout    file and folder names; create, find and list run directories
    read      the one error path of every reader (RunDirError: one line, exit 2)
    safe_files    writes that never follow a symbolic link; readers that never leave the run through one
    terminal  the one sanitiser of run-directory text printed on a terminal
    events    events.jsonl: the record format, the writer, the reader
    metrics   metrics.jsonl: append, cut back on resume, the last line
    ranks     Slurm slot <-> global rank (placement.rank_order), per-rank log and summary names
    local_state   submit/local.json, the local executor's record of a job
    process   whether a recorded PID is still the recorded process (start time, command line naming the run)
    sweep_file    sweep.json, checked
    states    the scheduler's live job states
    ports     the one MASTER_PORT formula
    restart   the restart policy: requeue or not after an attempt, and why (every backend)
"""
