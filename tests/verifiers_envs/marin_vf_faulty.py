"""A verifiers taskset whose second reward fails the way its config says: `raise`, `nan` or `slow`."""

import asyncio
import math
from typing import Literal

import verifiers.v1 as vf

__all__ = ["FaultyTaskset"]


class FaultyData(vf.TaskData):
    failure: str = ""


class FaultyTask(vf.Task[FaultyData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply == "2")

    @vf.reward(weight=0.5)
    async def faulty(self, trace) -> float:
        if self.data.failure == "raise":
            raise KeyError("missing field")
        if self.data.failure == "slow":
            await asyncio.sleep(60)
        return math.nan if self.data.failure == "nan" else 1.0


class FaultyConfig(vf.TasksetConfig):
    failure: Literal["", "raise", "nan", "slow"] = ""


class FaultyTaskset(vf.Taskset[FaultyTask, FaultyConfig]):
    def load(self):
        yield FaultyTask(FaultyData(prompt="1+1=", failure=self.config.failure), self.config.task)
