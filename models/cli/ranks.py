"""``--parallel``: every rank of ``mlx.launch`` runs the example; rank 0 talks, the others follow."""

from __future__ import annotations

import argparse
import sys


class Ranks:
    """``--parallel``: the ranks ``mlx.launch`` started, as the examples use them."""

    def __init__(self, args: argparse.Namespace):
        from models import parallel
        from models.parallel.session import shared_seed

        self.group = parallel.init()
        if self.group.size() < 2:
            raise parallel.ParallelSetupError(
                f"--parallel {args.parallel} needs two or more ranks; start it with mlx.launch, e.g. python -m "
                "models.parallel.launch --hosts h1,h2 --backend ring --python python3 -m examples.chat --parallel tensor ..."
            )
        self.rank, self.lead = self.group.rank(), None
        parallel.stop_on_sigterm(self.group)  # mlx.launch's SIGTERM after another rank ended: a RankLostError
        self.watchdog = parallel.Watchdog(self.group, args.rank_timeout)
        options = {name: getattr(args, name, None) for name in ("dtype", "q_bits", "q_group_size", "plan")}
        args.sharding = parallel.sharding_for(args.parallel, self.group, options)
        args.seed = shared_seed(self.group, args.seed)  # every rank samples the same tokens

    def session(self, session):
        """Rank 0's session, sharing each turn; None on the other ranks once they have followed rank 0's turns to its end."""
        from models.parallel.session import LeadSession, follow

        if self.rank == 0:
            self.lead = LeadSession(session, self.group, self.watchdog)
            return self.lead
        follow(session, self.group, self.watchdog)
        return None


def in_parallel(args: argparse.Namespace, run) -> int:
    """``run(args)``, or with ``--parallel`` ``run(args, ranks)`` on every rank: a lost rank or ranks that
    disagree end every rank with a named error (exit status ``EXIT_RANK_LOST`` or 2)."""
    if getattr(args, "parallel", None) is None:
        return run(args)
    from models import parallel
    from models.parallel.session import RanksDisagreeError

    try:
        ranks = Ranks(args)
        with parallel.rank_errors(ranks.group):
            code = run(args, ranks)
            if ranks.lead is not None:
                ranks.lead.close()
    except parallel.ParallelSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except (parallel.RankLostError, RanksDisagreeError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        code = parallel.EXIT_RANK_LOST
    parallel.report_exit(code)  # read by python -m models.parallel.launch
    return code
