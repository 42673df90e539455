"""The in-place protocol: one definition, used by the daemon and by plain torchrun's companion.

A lost peer's workers are left out of the next *generation* while the survivors' workers
keep their processes and re-form their group (``trainer.reform``). Two paths run this
protocol: the daemon (``supervisor`` decides, ``daemon`` acts) and, for plain torchrun
with ``--rdzv-conf recovery=in-place``, the plugin's companion inside the agent
(``rendezvous.companion``). Both take every rule from here, so a fix in one is a fix in
both (a tested contract, ``tests/inplace/test_contract.py``, runs the same scenarios
against both):

* ``loss``: who is lost, purely. A peer whose record vanished (etcd's majority decided:
  its lease expired) is confirmed by a probe; a peer whose record is present is lost only
  when a strict majority of the live members suspect it (``elasticd.quorum``), never by
  the votes of a node cut off from the majority.
* ``agreement``: the next generation, agreed by one compare-and-set on the job's
  ``generation`` key; the first survivor's write wins, the others adopt it. A drain in
  place is the same loop run by the leaver's daemon: a planned record without it; a join
  in place, run by the newcomer's daemon once its workers are warm: a planned record with it.
* ``handover``: the one writer of the workers' generation file.
* ``store``: the TCP store each survivor hosts, through which a re-formed group forms.

Nothing here imports the daemon's modules (``supervisor``, ``daemon``): the plugin loads
this package inside torchrun's agent.
"""
