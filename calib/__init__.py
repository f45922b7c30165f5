"""Calibration: streaming statistics, transform construction, and the calibrate glue."""
