"""Planner: hardware catalog, memory and cost models, layout search, topology. Pure Python; never imports torch."""
