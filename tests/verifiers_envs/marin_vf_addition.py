"""The quickstart's task as a verifiers taskset: `3+1=` -> `4`, reward 1 when the reply starts with the sum mod 10."""

import verifiers.v1 as vf

__all__ = ["AdditionTaskset"]


class AdditionData(vf.TaskData):
    answer: str = ""


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply[:1] == self.data.answer)


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10):
            yield AdditionTask(AdditionData(prompt=f"{a}+1=", answer=str((a + 1) % 10)), self.config.task)
