"""Checks of a property of the system on this machine: identity, resumption after kills, first executions."""
