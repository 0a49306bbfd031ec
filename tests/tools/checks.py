"""Soft checks for the test scripts: each failed check prints one FAILED line naming what broke,
and the script ends with done(), whose status is non-zero when any check failed."""


class Checks:
    def __init__(self, name):
        self.name = name
        self.failures = []

    def check(self, cond, *msg):
        if not cond:
            self.failures.append(" ".join(str(m) for m in msg))
            print(f"[{self.name}] FAILED:", *msg, flush=True)
        return cond

    def done(self, what):
        if self.failures:
            print(f"[{self.name}] {len(self.failures)} failed checks", flush=True)
            return 1
        print(f"[{self.name}] ok: {what}", flush=True)
        return 0
