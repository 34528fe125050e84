"""Views of schedules and simulations: the terminal grid and timeline, Chrome/Perfetto
traces and Gantt pictures. They read `SimResult`s and schedules; nothing here times or
transforms a schedule."""
