"""The machine the course runs on: device capabilities and the decisions made from them,
the environment report, optional packages, the smoke/cpu/gpu scale switch."""
