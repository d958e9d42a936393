"""Training data on the compute node: token streams (tokens.py: token files written by `hpctrain data
prepare`, synthetic tokens, the sampler that gives each dp rank its slice) and evaluation on the
validation file (evaluate.py). Preparing the files is torch-free login-node work (`hpctrain data prepare`)."""
