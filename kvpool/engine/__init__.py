"""The engine layer: requests, sampling parameters, the scheduler, the step loop and the offline API."""
