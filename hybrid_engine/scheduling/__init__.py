"""Scheduling: the ``Request``, the continuous-batching ``Scheduler``, its running-request table
and the commit of a step's outputs."""
