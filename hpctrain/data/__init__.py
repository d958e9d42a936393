"""`hpctrain data`: preparing training data on a login node, torch-free (a test checks it).

prepare.py turns documents into the flat token file the runtime reads (`train.data`) plus its
sidecar; sources.py reads the inputs (text, JSON lines, gzip, Parquet); tokenizer.py trains and
describes byte-level BPE tokenizers. Imports config and rundir only; the runtime reads what it
writes (hpctrain/runtime/data/tokens.py)."""
