"""Run reports: metrics of one or more training runs as PNG plots and one self-contained HTML page."""
