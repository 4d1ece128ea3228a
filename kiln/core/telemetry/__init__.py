"""Watching a run: the live metrics stream (S3), trackers, and Prometheus metrics.

``live`` owns the per-run progress object and metric lines under ``runs/<id>/live/``;
``trackers`` fans those lines out to TensorBoard, trackio or wandb on the gpu worker;
``prometheus`` owns Kiln's process metrics and the ``/metrics`` exposition.
"""
