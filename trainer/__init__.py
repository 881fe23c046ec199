"""The parts of a training run that are neither the model nor the data: its directory and
checkpoints, its metrics and W&B run, how it is split over processes, how it stops on a
scheduler's signal, and its profiler. train.py puts them together."""
