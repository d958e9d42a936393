"""`hpctrain export`: a run's DCP checkpoint -> a Hugging Face folder (hf.py) or, for a LoRA run, a
PEFT adapter or a merged model (lora.py). Needs torch (and safetensors), so it is not on the login
path: the CLI imports it only once the run and its checkpoint were found. Reads the runtime's model
and checkpoint code (hpctrain.runtime.model, hpctrain.runtime.checkpoint); imports config, plan,
rundir and runtime only."""
