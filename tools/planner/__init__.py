"""Sizing from measurement: fitted profiles, a discrete-event simulator of the pools, placements."""
