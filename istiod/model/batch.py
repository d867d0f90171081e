"""Batch facts: Jobs and CronJobs, as far as the mesh cares (which pods are done serving)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    namespace: str
    finished: bool  # a Complete or Failed condition is True
    cronjob: str = ""  # the controlling CronJob, if any


@dataclass(frozen=True, slots=True)
class CronJob:
    name: str
    namespace: str
    schedule: str
    suspended: bool = False
