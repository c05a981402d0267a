"""Fidelity evaluation: how many planted facts survive successive compactions (issue #12).

``python -m eval.fidelity --upstream URL --model NAME`` replays built-in long conversations
through a real proxy process and compares the facts it keeps with naive truncations at the
same forwarded budget; see docs/fidelity.md.
"""
