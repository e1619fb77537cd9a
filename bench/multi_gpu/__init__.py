"""Helpers of ``bench/multi_gpu_run.py`` (the multi-GPU lockstep run): copy limit, load, metrics, report."""
