"""Control's published job views: `surgectl status` lists jobs oldest submit first, in the
same order after a control restart (which publishes them in its journal's order: a fresh
user saw the list scrambled after `surgectl restart control`)."""

from __future__ import annotations

from services.contract import control_pb2
from services.control.orchestrator.views import JobViews


def test_the_listing_is_in_submit_order_whatever_order_the_jobs_were_published_in():
    views = JobViews()
    for job_id, created in (("c-3", 30.0), ("a-1", 10.0), ("b-2", 20.0), ("a-0", 10.0)):
        views.publish(control_pb2.JobStatus(job_id=job_id, created_unix=created), running_since=0.0)
    jobs, cordons = views.listing()
    assert [j.job_id for j in jobs] == ["a-0", "a-1", "b-2", "c-3"] and cordons == []
