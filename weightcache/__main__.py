from weightcache.cli import main

raise SystemExit(main())
