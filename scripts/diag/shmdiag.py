import os, subprocess
_last = [None]
OUT = os.environ.get("OUT", "/tmp")
def _log(msg):
    with open(os.path.join(OUT, "diag.txt"), "a") as f:
        f.write(msg + "\n")
def pytest_runtest_setup(item):
    mod = item.module.__name__
    if mod != _last[0]:
        _last[0] = mod
        _log(f"FDS {mod} {len(os.listdir('/proc/self/fd'))} children={subprocess.run(['ps','--ppid',str(os.getpid()),'-o','pid,cmd'],capture_output=True,text=True).stdout!r}")
def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None and "shm" in item.module.__name__:
        _log(f"FAIL {item.name} fds={len(os.listdir('/proc/self/fd'))}")
        _log(open("/proc/locks").read())
        _log(subprocess.run(["ps", "-ef", "--forest"], capture_output=True, text=True).stdout)
        _log(repr(sorted(os.listdir('/proc/self/fd'))))
        for fd in os.listdir('/proc/self/fd'):
            try: _log(f"fd {fd} -> {os.readlink('/proc/self/fd/'+fd)}")
            except OSError: pass
