from weightcache.cli import entry

entry()
