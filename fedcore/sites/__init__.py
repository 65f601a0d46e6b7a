"""Hub and sites: a site's policy, what it approves, and the checks its clients make."""
