"""A single-turn verifiers taskset with a weighted rubric: answer `i+i=`."""

import verifiers.v1 as vf

__all__ = ["SumTaskset"]


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.25)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) < 10)

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i in range(3):
            yield SumTask(SumData(prompt=f"{i}+{i}=", system_prompt="Digits only.", answer=str(2 * i)), self.config.task)
