! fortran_io.f90 -- gfortran's own OPEN on keys, under libinstride_preload.so:
!   fortran_io write <path> <text>     OPEN(STATUS='REPLACE'), WRITE, CLOSE
!   fortran_io read <path> <status>    OPEN(STATUS=<status>) without ACTION=, READ a line,
!                                      print it (exit 3: OPEN failed, 4: READ failed)
!   fortran_io scratch <path> <text>   OPEN(STATUS='REPLACE'), WRITE, CLOSE(STATUS='DELETE')
!                                      (exit 6: the CLOSE failed)
program fortran_io
  implicit none
  character(len=16) :: what
  character(len=4096) :: path
  character(len=256) :: arg, line
  integer :: ios

  call get_command_argument(1, what)
  call get_command_argument(2, path)
  call get_command_argument(3, arg)
  if (trim(what) == 'write') then
    open(unit=11, file=trim(path), status='replace', iostat=ios)
    if (ios /= 0) stop 3
    write(11, '(a)') trim(arg)
    close(11, iostat=ios)
    if (ios /= 0) stop 5
  else if (trim(what) == 'scratch') then
    open(unit=12, file=trim(path), status='replace', action='write', iostat=ios)
    if (ios /= 0) stop 3
    write(12, '(a)') trim(arg)
    close(12, status='delete', iostat=ios)
    if (ios /= 0) stop 6
  else
    open(unit=10, file=trim(path), status=trim(arg), iostat=ios)
    if (ios /= 0) stop 3
    read(10, '(a)', iostat=ios) line
    if (ios /= 0) stop 4
    print '(a)', trim(line)
    close(10)
  end if
end program fortran_io
