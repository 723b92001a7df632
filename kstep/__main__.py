from kstep.cli import main

raise SystemExit(main())
