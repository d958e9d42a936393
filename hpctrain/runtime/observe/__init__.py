"""What a run tells about itself: telemetry (telemetry.py: metrics.jsonl records, events, the rank
summaries, memory and throughput), measured communication waits (comm_timing.py) and the external
experiment trackers, TensorBoard, W&B and MLflow (trackers.py)."""
