"""Experiments of the paper: configs, runners, metrics and reports (see ``dselectk reproduce``)."""
