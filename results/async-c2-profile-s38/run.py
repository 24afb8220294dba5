import sys, pstats, cProfile, time
sys.path.insert(0, "scripts")
import engine_step_times as est
def profile_engine(loop, seconds):
    t_end = time.time() + 10
    while time.time() < t_end:
        loop.tick()
    prof = cProfile.Profile(); prof.enable()
    t_end = time.time() + seconds
    while time.time() < t_end:
        loop.tick()
    prof.disable(); prof.dump_stats("/tmp/s38/async.prof")
est.profile_engine = profile_engine
sys.argv = ["x", "--concurrency", "2", "--seconds", "40", "--profile", "async", "--temperature", "1"]
est.main()
