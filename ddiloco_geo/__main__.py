from ddiloco_geo.cli import main

raise SystemExit(main())
