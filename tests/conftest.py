"""Test-wide settings: nothing may reach the internet."""

from __future__ import annotations

import os

# litellm fetches its model map from the internet on import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
