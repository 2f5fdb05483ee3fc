"""Analyses of a partition, for people and tools: the per-graph report
(report.py), diffs between reports (diff.py) and a picture of the forward
graph (graph_svg.py). The backend writes reports; nothing here decides."""
