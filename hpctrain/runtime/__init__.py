"""Runtime: runs on compute nodes, one process per GPU. The only stage that imports torch."""
