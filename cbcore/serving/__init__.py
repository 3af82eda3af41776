"""Serving cbcore over the network (DESIGN.md §2, §10). The manager itself stays in `cbcore/manager.py`; this package
holds what sits in front of it: `server/`, the OpenAI-compatible HTTP server behind `python -m cbcore serve`."""
