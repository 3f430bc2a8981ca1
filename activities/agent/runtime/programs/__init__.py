"""Programs the process runtime offers its workers: this directory, and nothing else of Astraeus, is on a worker's
PYTHONPATH, so `python3 -m allreduce` (the gang example's all-reduce) runs from any directory and from an installed
wheel alike."""
